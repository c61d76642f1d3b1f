"""Training: the trainer's loop, the global loss-and-gradient step, the optimisers behind one stepper interface and the level plan."""
