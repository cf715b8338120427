# bench/med.sh: sourced by the bench scripts that summarise rounds (raid1_share.sh,
# mirror_nbd.sh).
# med "v1 v2 ..." FORMAT: "median (min..max)" of the values, each printed with FORMAT.
med() {
  tr ' ' '\n' <<<"$1" | grep . | sort -g | awk -v f="$2" '
    { v[NR] = $1 }
    END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2
          printf f " (" f ".." f ")", m, v[1], v[NR] }'
}
