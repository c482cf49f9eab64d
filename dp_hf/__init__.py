"""dp_hf: differentially private fine-tuning of Hugging Face models."""

__version__ = "0.1.0"
