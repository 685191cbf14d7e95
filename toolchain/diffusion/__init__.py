"""Diffusion LMs: the checkpoint form, adaptation training, decision rules, a torch reference."""
