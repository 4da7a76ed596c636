"""Distillation: the KD loss, data order, checkpoints and the Trainer over them (its schedule and checks:
tcal.utils.fit)."""
