"""Model families (one subpackage or module each) and the registry that names their stages."""
