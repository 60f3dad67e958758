"""CP x TP parallelism (Zigzag layout, KDA state passing): lands with its own issue."""
