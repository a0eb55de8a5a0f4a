"""The slim IREE runtime: loads compiled artifacts, binds the safetensors weights and decodes (plain and DFlash), with no torch."""
