"""Training loops written against the Engine; each is a module that `multigpu run` can start."""
