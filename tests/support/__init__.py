"""What the tests share: brute-force references, scenario inputs, job launchers and result checks."""
