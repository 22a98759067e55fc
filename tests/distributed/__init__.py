"""Multi-rank gloo jobs: CompressedBackend and LionCub on 1-4 real ranks."""
