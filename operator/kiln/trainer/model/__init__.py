"""Models: the decoder (transformer), its loss, fused kernels, and Hugging Face folders in and out."""
