"""Conversion side: repair, link and convert PyTorch host/device traces into Chakra .et files (imports no torch)."""
