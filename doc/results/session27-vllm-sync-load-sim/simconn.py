from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
class SimMeta(KVConnectorMetadata):
    pass
class SimConnector(KVConnectorBase_V1):
    MATCH = {}
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = self.MATCH.pop(request.request_id, 0)
        return n, False
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass
    def build_connector_meta(self, scheduler_output):
        return SimMeta()
    def start_load_kv(self, *a, **k): pass
    def wait_for_layer_load(self, *a): pass
    def save_kv_layer(self, *a, **k): pass
    def wait_for_save(self): pass
    def request_finished(self, request, block_ids):
        return False, None
