__version__ = "0.1.0"  # the library version written into every manifest
