"""Training loop: Trainer, LossLog, ProgressBar."""
