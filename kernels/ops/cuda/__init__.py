"""CUDA C++ kernels for what Triton cannot express, built with nvcc and launched through the driver.

Triton 3.6 has no thread-block clusters or distributed shared memory; the one-read GRPO loss needs
them (a row of 152k bf16 logits is 297 KiB, more than one multiprocessor's shared memory, so the
row lives in the shared memory of a cluster of CTAs between its two sweeps). Each kernel here sits
beside its host-side module (``<op>_<variant>.cu`` + ``<op>_<variant>.py``); ``build`` compiles and
launches them. Everything here is optional: without nvcc or a Hopper GPU the op runs its Triton path.
"""
