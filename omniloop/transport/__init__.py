"""Wire types, frame codec and ZMQ channels. Nothing here pickles."""
