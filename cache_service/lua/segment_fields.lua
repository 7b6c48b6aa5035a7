-- Meta and the names of the frame fields of segments overlapping [lo, hi).
-- (Names only: copying multi-megabyte frames through Lua costs Redis ~8x the CPU of a
-- plain HMGET of the same fields, measured in bench/service_bench.py.)
-- KEYS[1]  rollout hash
-- ARGV     lo, hi   (hi = -1: no upper bound)
-- Returns  {} when the rollout does not exist, else {meta, field1, field2, ...}
local key = KEYS[1]
local lo, hi = tonumber(ARGV[1]), tonumber(ARGV[2])
local meta = redis.call('HGET', key, 'm')
if not meta then return {} end
local out = {meta}
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^s:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if b > lo and (hi < 0 or a < hi) then out[#out + 1] = f end
  end
end
return out
