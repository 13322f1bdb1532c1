"""E2E engines: each turns an A/B spec into two real training runs (arms) and per-step series.

``trl_engine``: TRL's GRPOTrainer on a tiny real Qwen3 (``tiny_models``) and a synthetic task with
a verifiable reward (``task``), one subprocess per arm.
"""
