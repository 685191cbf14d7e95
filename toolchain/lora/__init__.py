"""LoRA adapters for artifacts compiled with lora_inputs: PEFT packing, verification against
PEFT, and the adapters bound to QNN HTP binaries (binding itself is runtime/adapters.py)."""
