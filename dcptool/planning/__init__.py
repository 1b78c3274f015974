"""What goes out, where: conversions, reshards over meshes, computed views (quantization, LoRA), plans and configs."""
