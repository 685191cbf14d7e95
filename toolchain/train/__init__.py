"""Training of the small assets the runtime uses: one loop, one corpus (one train/held-out
split), drafts, the lever predictor, LoRA adapters, DS2D forecasts and diffusion LMs."""
