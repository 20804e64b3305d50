"""Workers as Ray actors (backend="ray"): the transport and the actor."""
