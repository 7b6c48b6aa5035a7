-- A rollout's meta, segment infos, byte totals and remaining TTL, without frame bodies.
-- KEYS[1]  rollout hash
-- Returns  {} when absent, else {meta, total_bytes, shared_bytes, pttl, nviews,
--          serves1, view_info1, ..., info1, info2, ...} (view infos: put_view_ref.lua)
local key = KEYS[1]
local meta = redis.call('HGET', key, 'm')
if not meta then return {} end
local out = {meta, redis.call('HGET', key, 'b') or '0', redis.call('HGET', key, 'sb') or '0',
             redis.call('PTTL', key), 0}
local views = {}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves then
    views[#views + 1] = serves
    views[#views + 1] = redis.call('HGET', key, f)
  end
end
out[5] = #views / 2
for _, v in ipairs(views) do out[#out + 1] = v end
for _, f in ipairs(redis.call('HKEYS', key)) do
  if string.sub(f, 1, 2) == 'h:' then out[#out + 1] = redis.call('HGET', key, f) end
end
return out
