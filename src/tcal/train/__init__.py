"""Distillation: the KD loss, data order, schedule, checkpoints and the Trainer over them."""
