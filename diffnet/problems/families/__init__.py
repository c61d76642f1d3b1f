"""The built-in PDE families: Burgers, Darcy, Poisson (2-D and 3-D), reaction-diffusion, and the numerics they share."""
