pytest_plugins = ["devmesh.testing"]
