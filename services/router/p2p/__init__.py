"""Peer-to-peer prefix pull: the engine the router picks READs a long cached prefix from the engine holding it."""
