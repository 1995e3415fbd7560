"""Memory mechanisms: plain synchronous classes that decide nothing and do no I/O."""
