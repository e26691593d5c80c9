"""Native CPU kernels: small C files compiled on this machine at first use (build.py)
and called through ctypes, each with a plain-torch fallback where no compiler is found."""
