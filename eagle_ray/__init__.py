"""eagle_ray: train EAGLE-3 speculative-decoding drafters on your own traffic, on Ray."""

__version__ = "0.1.0"
