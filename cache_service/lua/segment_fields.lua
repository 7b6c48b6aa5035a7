-- Meta and the names of the frame fields of segments overlapping [lo, hi).
-- (Names only: copying multi-megabyte frames through Lua costs Redis ~8x the CPU of a
-- plain HMGET of the same fields, measured in bench/service_bench.py.)
-- KEYS[1]  rollout hash
-- ARGV     lo, hi   (hi = -1: no upper bound)
-- Returns  {} when the rollout does not exist, else {meta, stored_end, field1, ...}: the
--          last stored row + 1, the overlapping s:<a>:<b> fields and every c:<digest> field
local key = KEYS[1]
local lo, hi = tonumber(ARGV[1]), tonumber(ARGV[2])
local meta = redis.call('HGET', key, 'm')
if not meta then return {} end
local out = {meta, 0}
local stored_end = 0
for _, f in ipairs(redis.call('HKEYS', key)) do
  local a, b = string.match(f, '^s:(%d+):(%d+)$')
  if a then
    a = tonumber(a); b = tonumber(b)
    if b > stored_end then stored_end = b end
    if b > lo and (hi < 0 or a < hi) then out[#out + 1] = f end
  elseif string.sub(f, 1, 2) == 'c:' then
    out[#out + 1] = f
  end
end
out[2] = stored_end
return out
