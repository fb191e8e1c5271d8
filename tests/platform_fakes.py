"""A stand-in for the AbstractMesh a platform decision reads (kernels/backend.py `_traced_platform`): not
empty, and its `abstract_device.platform`. Lets the tests ask what a TPU-traced program would choose
without compiling one."""


class FakeDevice:
    def __init__(self, platform: str):
        self.platform = platform


class FakeMesh:
    """What the platform decisions read of an AbstractMesh."""

    def __init__(self, platform: str):
        self.empty, self.abstract_device = False, FakeDevice(platform)
