"""Conversion: surgery (teacher -> hybrid), the init registry and its execution, layer policies and selection, convert()."""
