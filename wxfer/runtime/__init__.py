"""The trainer and inference sides at run time: Sender (the step hook), Receiver, the control
plane on torch.distributed, the plan adapter (program) and the prepare stage, verify mode,
trace export."""
