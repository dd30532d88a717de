"""The SmolLM2 recipe: prepare the model, run GRPO on the arithmetic task, evaluate."""
