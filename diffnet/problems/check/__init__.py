"""The problem checker: does a PDE family keep the contract? One function per check."""
