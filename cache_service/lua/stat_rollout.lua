-- A rollout's meta, segment infos, byte totals, memory and remaining TTL, without frame bodies.
-- KEYS[1]  rollout hash
-- Returns  {} when absent, else {meta, total_bytes, shared_bytes, pttl, nviews, memory,
--          serves1, view_info1, ..., info1, info2, ...} (view infos: put_view.lua);
--          memory = MEMORY USAGE (every field) of the rollout hash and of each view's hash,
--          -1 when the operator disabled MEMORY.  A rollout holds at most max_views views
--          and max_segments segments (both bounded at write), so the reply is bounded.
local key = KEYS[1]
local meta = redis.call('HGET', key, 'm')
if not meta then return {} end
local function usage(k)
  local m = redis.pcall('MEMORY', 'USAGE', k, 'SAMPLES', '0')
  if type(m) == 'number' then return m end
  if type(m) == 'table' and m.err then return -1 end
  return 0  -- the key is gone (nil)
end
local mem = usage(key)
local out = {meta, redis.call('HGET', key, 'b') or '0', redis.call('HGET', key, 'sb') or '0',
             redis.call('PTTL', key), 0, 0}
local views, infos = {}, {}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local serves = string.match(f, '^v:(%d+)$')
  if serves then
    views[#views + 1] = serves
    views[#views + 1] = redis.call('HGET', key, f)
    if mem >= 0 then
      local m = usage(key .. ':v:' .. serves)
      if m < 0 then mem = -1 else mem = mem + m end
    end
  elseif string.sub(f, 1, 2) == 'h:' then
    infos[#infos + 1] = redis.call('HGET', key, f)
  end
end
out[5] = #views / 2
out[6] = mem
for _, v in ipairs(views) do out[#out + 1] = v end
for _, v in ipairs(infos) do out[#out + 1] = v end
return out
