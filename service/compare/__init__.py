"""Compare the head types of two or more models, head by head (pre-trained vs fine-tuned)."""
