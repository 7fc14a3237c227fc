"""The ground floor: mechanics every subsystem shares (torch's release-dependent APIs, process
groups, argument checks, the rank maps' ownership, scoped caches, the layout check, memory
aliasing, local launches). Its modules import nothing from the rest of the package."""
