"""The phone cost model: latency from bytes read (flash, DRAM) and FLOPs per device profile
(devices.yaml), ONNX graph costing, calibration from measured profiles, and the per-call prices
the tree policies decide with."""
