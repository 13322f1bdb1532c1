"""A tiny third-party operator backend, written the way a team outside this repository would.

It lives in its own importable package (``rlk_example_backend``), is registered by dotted path
(``--rlk-backend rlk_example_backend.backend:make_backend`` or
``VIME_RL_KERNEL_BACKEND=rlk_example_backend.backend:make_backend``) or by the entry point in
``../pyproject.toml``, and is validated by the suite's op tier without any change to the suite.
"""
