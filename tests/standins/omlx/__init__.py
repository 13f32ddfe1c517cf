"""A stand-in for omlx (github.com/jundot/omlx), which is not on the package index and whose Metal kernels do
not run on Linux: its DeepSeek-V4 + DSpark overlay entry points under the same names and signatures, over
mlx-lm's own deepseek_v41 classes, for tests (put tests/standins on PYTHONPATH)."""
