"""The checkpoint model and the bytes: the format-neutral description, views over chunks, the copy engine, values read region by region, zstd records, torchrun scale-out."""
