"""The services of the yinian mesh, one package per inference stage."""
