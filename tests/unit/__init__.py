"""In-process tests (seconds): options, buckets, packing, quantizers, LionCub at a world of one."""
