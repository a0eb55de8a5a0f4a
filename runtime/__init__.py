"""The slim IREE runtime: loads compiled artifacts and decodes, with no torch. Not built yet."""
