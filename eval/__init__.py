"""lm-eval integration and accuracy checks: lands with its own issue."""
