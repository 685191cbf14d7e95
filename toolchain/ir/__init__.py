"""The compiler's graph model: GraphSet (families of onnx_ir graphs) and the onnx_ir helpers
passes and compile stages share."""
