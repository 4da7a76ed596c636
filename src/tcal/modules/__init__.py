"""Building blocks of the GDN layer: norms, short convolution, the GatedDeltaNet module and its options."""
