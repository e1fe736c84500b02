"""The slice of ParallelDims that single-process tests and GPU scripts use, without torch.distributed: a
world of one, where every collective returns this rank's own values."""


class OneRank:
    world_size, rank, local_rank, is_main, world_group = 1, 0, 0, True, None
    dp, sp, ep, dp_rank, sp_rank = 1, 1, 1, 0, 0

    def all_gather_objects(self, obj, group=None):
        return [obj]

    def all_reduce_sum(self, values, group=None):
        return [float(v) for v in values]

    def all_reduce_tensors(self, values, group=None, op=None):
        return {k: float(v) for k, v in values.items()}

    def exchange_objects(self, outgoing, group=None):
        assert not outgoing, "a world of one sends nothing"
        return {}

    def barrier(self):
        pass

    def on_main(self, what, fn):
        fn()
