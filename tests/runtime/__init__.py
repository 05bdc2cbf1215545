"""The runtime, the ground floor: forests, the package format, the ABI, loading without the compiler."""
