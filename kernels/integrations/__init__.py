"""Adapters that install our kernels into RL frameworks through their public hooks.

``kernels.integrations.vime``: vime's custom loss (``--loss-type custom_loss
--custom-loss-function-path kernels.integrations.vime.policy_loss``) and init hook
(``--custom-megatron-init-path kernels.integrations.vime.init_hook``).
"""
