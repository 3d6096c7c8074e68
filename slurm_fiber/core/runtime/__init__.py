"""The runtime: grant decisions carried out with templates, fibers, cgroups and devices."""
