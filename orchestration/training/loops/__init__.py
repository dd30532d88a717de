"""The training loops: ``run_sft_training`` (``sft_loop``) and ``run_rl_training`` (``rl_loop``)."""
