// The translation unit that shardcast_pch precompiles common/precompiled.h for.
